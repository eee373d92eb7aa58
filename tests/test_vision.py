"""Vision-language foundations: `builtin:tiny-vl` builds offline and runs a padded batch of
prompts with 1, 2 and 0 images; the three prompt layouts encode the same; the run's image
store writes each content once and its verify catches a corrupted file; bad image input
exits 2 with one line naming the row and the field."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import png

from rftpipe.data.images import VisionPrompt, vision_prompt
from rftpipe.engines.models import prepare_tiny
from rftpipe.engines.vision import (
    EncodedPrompt,
    VisionEncoder,
    collate,
    require_vision_model,
    rope_position_ids,
)
from rftpipe.errors import UserError
from rftpipe.inspect.verify import verify_run
from rftpipe.storage.images import ImageStore, quarantine_corrupt_images, verify_images


@pytest.fixture(scope="module")
def model(tiny_vl: Path) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_vl).eval()


@pytest.fixture
def images(tmp_path: Path) -> list[Path]:
    paths = []
    for i, (w, h) in enumerate([(56, 56), (80, 60), (40, 90), (56, 56)]):
        paths.append(tmp_path / f"im{i}.png")
        paths[-1].write_bytes(png(i, w, h))
    return paths


def logits(model: Any, encoded: list[EncodedPrompt], pad_id: int) -> torch.Tensor:
    with torch.no_grad():
        return model(**collate(encoded, pad_id)).logits


@pytest.mark.kernels
def test_tiny_vl_runs_a_padded_batch_with_and_without_images(
    tiny_vl: Path, model: Any, vl_encoder: VisionEncoder, images: list[Path]
) -> None:
    assert 13e6 < sum(p.numel() for p in model.parameters()) < 20e6
    one = vision_prompt("<image>What is it?", str(images[0]), row="row 0")
    two = vision_prompt(
        "<image> or <image>: which is taller?", [str(images[1]), str(images[2])], row="row 1"
    )
    text = vision_prompt("no picture here, just text", row="row 2")
    encoded = [vl_encoder.encode(p) for p in (one, two, text)]
    # 56x56 -> a 4x4 patch grid -> 4 tokens; 80x60 and 40x90 resize to 84x56 and 56x84.
    assert [e.num_image_tokens for e in encoded] == [4, 12, 0]
    assert encoded[1].image_grid_thw is not None
    assert encoded[1].image_grid_thw.tolist() == [[1, 4, 6], [1, 6, 4]]
    assert [vl_encoder.count_tokens(p) for p in (one, two, text)] == [
        len(e.input_ids) for e in encoded
    ]

    pad = vl_encoder.tokenizer.pad_token_id
    batch = logits(model, encoded, pad)
    assert torch.isfinite(batch).all()
    # Left padding: each row's own logits sit at the right end of the batch.
    for e, row in zip(encoded, batch, strict=True):
        alone = logits(model, [e], pad)[0]
        torch.testing.assert_close(row[-len(e.input_ids) :], alone, atol=1e-4, rtol=1e-4)
    assert rope_position_ids(model, collate(encoded, pad)).shape == (3, 3, batch.shape[1])


@pytest.mark.kernels
def test_the_image_changes_only_the_logits_after_it(
    model: Any, vl_encoder: VisionEncoder, images: list[Path]
) -> None:
    a = vl_encoder.encode(vision_prompt("Look: <image> colour?", str(images[0]), row="row 0"))
    b = vl_encoder.encode(vision_prompt("Look: <image> colour?", str(images[3]), row="row 1"))
    assert a.input_ids == b.input_ids
    first = a.mm_token_type_ids.index(1)
    la, lb = (logits(model, [e], vl_encoder.tokenizer.pad_token_id)[0] for e in (a, b))
    torch.testing.assert_close(la[:first], lb[:first])
    after = slice(first + a.num_image_tokens, None)
    assert (la[after] - lb[after]).abs().max() > 1e-3


def test_the_layouts_encode_the_same(vl_encoder: VisionEncoder, images: list[Path]) -> None:
    data = images[1].read_bytes()
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    question = "Which colour?"
    layouts: dict[str, VisionPrompt] = {
        "content parts": vision_prompt(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "path": str(images[1])},
                        {"type": "text", "text": question},
                    ],
                }
            ],
            row="row 0",
        ),
        "image_url data URI": vision_prompt(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": uri}},
                        {"type": "text", "text": question},
                    ],
                }
            ],
            row="row 0",
        ),
        "parts + images column": vision_prompt(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
            [{"bytes": data, "path": None}],
            row="row 0",
        ),
        "verl": vision_prompt(
            [{"role": "user", "content": f"<image>{question}"}],
            [{"bytes": None, "path": "im1.png"}],
            row="row 0",
            base_dir=images[1].parent,
        ),
        "path string": vision_prompt(f"<image>{question}", str(images[1]), row="row 0"),
    }
    encoded = {name: vl_encoder.encode(p) for name, p in layouts.items()}
    ref = encoded["content parts"]
    assert ref.num_image_tokens == 6 and ref.pixel_values is not None
    for name, e in encoded.items():
        assert e.input_ids == ref.input_ids, name
        assert e.pixel_values is not None and torch.equal(e.pixel_values, ref.pixel_values), name


def test_a_datasets_image_column(vl_encoder: VisionEncoder, images: list[Path]) -> None:
    """HF `datasets` with an `Image` feature: the decoded PIL cell and the raw one agree."""
    import datasets

    ds = datasets.Dataset.from_dict(
        {"prompt": ["<image>Which colour?"], "images": [[str(images[2])]]},
        features=datasets.Features(
            {"prompt": datasets.Value("string"), "images": [datasets.Image()]}
        ),
    )
    decoded = vision_prompt(ds[0]["prompt"], ds[0]["images"], row="row 0")
    raw = vision_prompt(
        ds.data.table.to_pylist()[0]["prompt"], ds.data.table.to_pylist()[0]["images"], row="row 0"
    )
    by_path = vision_prompt("<image>Which colour?", str(images[2]), row="row 0")
    encoded = [vl_encoder.encode(p) for p in (decoded, raw, by_path)]
    assert encoded[0].input_ids == encoded[1].input_ids == encoded[2].input_ids
    assert all(torch.equal(e.pixel_values, encoded[2].pixel_values) for e in encoded)  # type: ignore[arg-type]


def test_max_pixels_bounds_the_image_tokens(tiny_vl: Path, images: list[Path]) -> None:
    small = VisionEncoder.load(tiny_vl, max_pixels=56 * 56)
    prompt = vision_prompt("<image>?", str(images[1]), row="row 0")  # 80x60
    e = small.encode(prompt)
    # 84x56 (what the default range keeps, 6 tokens) is over 56*56 pixels: scaled down
    # and floored to multiples of 28, it becomes 56x28, a 2x4 patch grid, 2 tokens.
    assert e.image_grid_thw is not None and e.image_grid_thw.tolist() == [[1, 2, 4]]
    assert e.num_image_tokens == 2 and small.count_tokens(prompt) == len(e.input_ids)


def test_the_store_writes_each_image_once_and_verify_rehashes(
    tmp_path: Path, images: list[Path]
) -> None:
    store = ImageStore(tmp_path)
    same = [vision_prompt("<image>a", str(images[0]), row=f"row {i}") for i in range(3)]
    other = vision_prompt("<image><image>b", [str(images[0]), str(images[1])], row="row 3")
    refs = [r for p in [*same, other] for r in p.store(store)]
    files = sorted(f for f in (tmp_path / "images").rglob("*") if f.is_file())
    assert len(files) == 2  # 5 references, 2 distinct images
    assert {r.relpath for r in refs} == {str(f.relative_to(tmp_path)) for f in files}
    for r in refs:
        assert hashlib.sha256(store.path(r).read_bytes()).hexdigest() == r.sha256
        assert r.relpath == f"images/{r.sha256[:2]}/{r.sha256}.png"
    inode = store.path(refs[0]).stat().st_ino
    store.put(images[0].read_bytes(), "png")
    assert store.path(refs[0]).stat().st_ino == inode  # not rewritten
    assert verify_images(tmp_path) == []

    victim = store.path(refs[-1])
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = verify_images(tmp_path)
    assert [b.path for b in bad] == [victim]
    audit = verify_run(tmp_path)
    assert audit.images == 2 and [b["path"] for b in audit.corrupt] == [str(victim)]

    # The repair path: the corrupt file leaves the store, the next put writes it afresh.
    assert quarantine_corrupt_images(tmp_path, tmp_path / "quarantine") == [victim]
    assert not victim.exists() and verify_images(tmp_path) == []
    other.store(store)
    assert victim.exists() and verify_images(tmp_path) == []


BAD_INPUTS: dict[str, tuple[dict[str, Any], str]] = {
    "missing image": (
        {"prompt": "<image>?", "images": "nowhere.png"},
        "row 7: 'images'[0]: cannot read image 'nowhere.png'",
    ),
    "unreadable image": (
        {"prompt": "<image>?", "images": [{"bytes": b"not a png at all", "path": None}]},
        "row 7: 'images'[0]: cannot decode the image",
    ),
    "more images than placeholders": (
        {"prompt": "<image>?", "images": ["a.png", "b.png"]},
        "row 7: 'prompt' has 1 image placeholders but 'images' holds 2 images",
    ),
    "fewer images than placeholders": (
        {"prompt": "<image><image>?", "images": ["a.png"]},
        "row 7: 'prompt' has 2 image placeholders but 'images' holds 1 images",
    ),
    "remote url": (
        {
            "prompt": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
                }
            ]
        },
        "row 7: 'prompt' message 0 part 0: remote image",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_image_input_is_one_line_naming_row_and_field(case: str, tmp_path: Path) -> None:
    cell, message = BAD_INPUTS[case]
    with pytest.raises(UserError) as err:
        vision_prompt(cell["prompt"], cell.get("images"), row="row 7", base_dir=tmp_path)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert err.value.exit_code == 2


def test_an_image_prompt_for_a_text_only_model(images: list[Path]) -> None:
    prompt = vision_prompt("<image>?", str(images[0]), row="row 4")
    require_vision_model(prepare_tiny(), vision_prompt("text", row="row 5"), "row 5", "prompt")
    with pytest.raises(
        UserError, match=r"^row 4: 'prompt' holds 1 images but the model .* is text-only"
    ):
        require_vision_model(prepare_tiny(), prompt, "row 4", "prompt")
    with pytest.raises(UserError, match="text-only"):
        VisionEncoder.load(prepare_tiny())


def test_another_vision_family_is_refused(tmp_path: Path) -> None:
    config = {"model_type": "llava", "vision_config": {}, "image_token_id": 32000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UserError, match=r"^model.path: .* is a 'llava' model; images are encoded for"
    ):
        VisionEncoder.load(tmp_path)


def test_a_prompt_spelling_the_image_token(vl_encoder: VisionEncoder) -> None:
    """Text that spells the image-pad token would shift every image's tokens: refused."""
    prompt = vision_prompt("say <|image_pad|> please", row="row 9")
    with pytest.raises(UserError, match=r"^row 9: .* rendered 1 '<\|image_pad\|>' tokens"):
        vl_encoder.encode(prompt, row="row 9")


def test_greedy_generate_from_a_mixed_batch(
    model: Any, vl_encoder: VisionEncoder, images: list[Path]
) -> None:
    """What a rollout engine will call: the batched continuation is each prompt's alone."""
    from transformers import GenerationConfig

    pad = vl_encoder.tokenizer.pad_token_id
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=pad)
    prompts = [
        vision_prompt("<image>What is it?", str(images[0]), row="row 0"),
        vision_prompt("just text", row="row 1"),
    ]
    encoded = [vl_encoder.encode(p) for p in prompts]
    with torch.no_grad():
        batch = model.generate(**collate(encoded, pad), generation_config=gen)[:, -4:]
        for e, row in zip(encoded, batch, strict=True):
            alone = model.generate(**collate([e], pad), generation_config=gen)[0, -4:]
            assert row.tolist() == alone.tolist()
