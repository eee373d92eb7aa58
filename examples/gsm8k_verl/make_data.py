"""Write gsm8k_mini.parquet: 30 grade-school word problems, written for this example, in
verl's GSM8K Parquet layout (what verl's examples/data_preprocess/gsm8k.py produces).

    python examples/gsm8k_verl/make_data.py

Each row: `data_source` "openai/gsm8k", `prompt` [{role: user, content: question +
instruction}], `ability` "math", `reward_model` {style: rule, ground_truth: the number
after "####"}, `extra_info` {split, index, answer: the worked solution, question}.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

#: (question, worked solution ending in "#### <answer>").
PROBLEMS: list[tuple[str, str]] = [
    ("Mia has 12 stickers. She buys 3 packs of 5 stickers. How many stickers does she have now?",
     "3 packs hold 3*5=<<3*5=15>>15 stickers.\nMia has 12+15=<<12+15=27>>27 stickers.\n#### 27"),
    ("A baker makes 48 rolls and sells half of them by noon. How many rolls are left?",
     "Half of 48 is 48/2=<<48/2=24>>24.\n48-24=<<48-24=24>>24 rolls are left.\n#### 24"),
    ("Tom reads 15 pages a day. How many pages does he read in 6 days?",
     "15*6=<<15*6=90>>90 pages.\n#### 90"),
    ("A farmer has 7 rows of apple trees with 9 trees in each row. He plants 5 more trees. How many trees are there?",
     "7*9=<<7*9=63>>63 trees.\n63+5=<<63+5=68>>68 trees.\n#### 68"),
    ("Lena saves $4 every week. How many weeks does she need to save $52?",
     "52/4=<<52/4=13>>13 weeks.\n#### 13"),
    ("A bus has 40 seats. 27 people are on the bus. At the next stop 8 people get off and 15 get on. How many seats are empty?",
     "27-8+15=<<27-8+15=34>>34 people.\n40-34=<<40-34=6>>6 seats are empty.\n#### 6"),
    ("Sam buys 3 notebooks at $2 each and a pen for $3. He pays with a $20 bill. How much change does he get?",
     "3*2=<<3*2=6>>6 dollars for notebooks.\n6+3=<<6+3=9>>9 dollars in all.\n20-9=<<20-9=11>>11.\n#### 11"),
    ("A garden is 8 meters long and 5 meters wide. What is its area in square meters?",
     "8*5=<<8*5=40>>40 square meters.\n#### 40"),
    ("Nora has 36 marbles. She gives a third of them to her brother. How many does she keep?",
     "36/3=<<36/3=12>>12 given away.\n36-12=<<36-12=24>>24 kept.\n#### 24"),
    ("A shop sells pencils in boxes of 10. A school needs 125 pencils. How many boxes must it buy?",
     "125/10=12.5, so 13 boxes are needed.\n#### 13"),
    ("Ben runs 3 km on Monday, twice as far on Tuesday, and 2 km on Wednesday. How many km does he run in all?",
     "Tuesday: 3*2=<<3*2=6>>6 km.\n3+6+2=<<3+6+2=11>>11 km.\n#### 11"),
    ("A cake is cut into 16 slices. 5 children eat 2 slices each. How many slices are left?",
     "5*2=<<5*2=10>>10 slices eaten.\n16-10=<<16-10=6>>6 left.\n#### 6"),
    ("Ava earns $9 an hour. She works 7 hours on Saturday and 5 hours on Sunday. How much does she earn?",
     "7+5=<<7+5=12>>12 hours.\n12*9=<<12*9=108>>108 dollars.\n#### 108"),
    ("A train travels 60 km each hour. How far does it go in 4 hours?",
     "60*4=<<60*4=240>>240 km.\n#### 240"),
    ("There are 25 students in a class. 3 of every 5 students walk to school. How many students walk?",
     "25/5=<<25/5=5>>5 groups of five.\n5*3=<<5*3=15>>15 walk.\n#### 15"),
    ("Leo has 5 boxes with 8 crayons each. He loses 7 crayons. How many crayons does he have?",
     "5*8=<<5*8=40>>40 crayons.\n40-7=<<40-7=33>>33 crayons.\n#### 33"),
    ("A tank holds 90 liters. It is one third full. How many more liters fit in it?",
     "90/3=<<90/3=30>>30 liters in it.\n90-30=<<90-30=60>>60 liters more.\n#### 60"),
    ("Zoe buys 4 tickets for $12 each and pays a $5 booking fee. What is the total cost?",
     "4*12=<<4*12=48>>48 dollars.\n48+5=<<48+5=53>>53 dollars.\n#### 53"),
    ("A hen lays 6 eggs a week. How many eggs do 4 hens lay in 3 weeks?",
     "4*6=<<4*6=24>>24 eggs a week.\n24*3=<<24*3=72>>72 eggs.\n#### 72"),
    ("Max had 100 coins. He spent 35 and then found 12. How many coins does he have?",
     "100-35=<<100-35=65>>65.\n65+12=<<65+12=77>>77 coins.\n#### 77"),
    ("A rope is 84 cm long. It is cut into 7 equal pieces. How long is each piece in cm?",
     "84/7=<<84/7=12>>12 cm.\n#### 12"),
    ("Ella reads 2 books a month. How many books does she read in 2 years?",
     "2 years are 2*12=<<2*12=24>>24 months.\n24*2=<<24*2=48>>48 books.\n#### 48"),
    ("A parking lot has 6 rows of 14 spaces. 59 cars are parked. How many spaces are free?",
     "6*14=<<6*14=84>>84 spaces.\n84-59=<<84-59=25>>25 free.\n#### 25"),
    ("Jack is 4 years older than Kim. Kim is 9. How old will Jack be in 5 years?",
     "Jack is 9+4=<<9+4=13>>13.\n13+5=<<13+5=18>>18.\n#### 18"),
    ("A box of 24 oranges costs $6. How much does one orange cost in cents?",
     "$6 is 600 cents.\n600/24=<<600/24=25>>25 cents.\n#### 25"),
    ("Ivy plants 3 rows of 11 tulips and 2 rows of 8 roses. How many flowers does she plant?",
     "3*11=<<3*11=33>>33 tulips.\n2*8=<<2*8=16>>16 roses.\n33+16=<<33+16=49>>49.\n#### 49"),
    ("A library had 250 books. It lent out 68 and got 30 new ones. How many books are on its shelves?",
     "250-68=<<250-68=182>>182.\n182+30=<<182+30=212>>212 books.\n#### 212"),
    ("A pizza costs $14. Four friends share 2 pizzas equally. How much does each pay?",
     "2*14=<<2*14=28>>28 dollars.\n28/4=<<28/4=7>>7 dollars each.\n#### 7"),
    ("Omar walks 1500 meters to school and back each day. How many meters does he walk in 5 school days?",
     "1500*2=<<1500*2=3000>>3000 meters a day.\n3000*5=<<3000*5=15000>>15000 meters.\n#### 15000"),
    ("A jar has 18 red and 27 blue beads. Rosa takes out 9 beads. How many beads are left?",
     "18+27=<<18+27=45>>45 beads.\n45-9=<<45-9=36>>36 left.\n#### 36"),
]  # fmt: skip


def rows(split: str = "train") -> list[dict]:
    """The problems as verl GSM8K rows."""
    out = []
    for i, (question, solution) in enumerate(PROBLEMS):
        out.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": solution.split("#### ")[-1]},
                "extra_info": {
                    "split": split,
                    "index": i,
                    "answer": solution,
                    "question": question,
                },
            }
        )
    return out


def main() -> None:
    out = Path(__file__).resolve().parent / "gsm8k_mini.parquet"
    pq.write_table(pa.Table.from_pylist(rows()), out)
    print(f"wrote {len(PROBLEMS)} rows to {out}")


if __name__ == "__main__":
    main()
