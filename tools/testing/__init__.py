"""The test suite's machinery: its runner in phases and lanes (`runner`, run as
`python -m tools.test`), the warm interpreter that forks its run workers (`zygote`), the
coverage of its tiers (`coverage_tiers`), the static inventory of what it checks
(`test_inventory`) and the CPU accounting of a run (`proc_account`). docs/testing.md."""
