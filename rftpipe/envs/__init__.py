"""Multi-turn environments for agent rollouts (torch-free).

`base` holds the interface (`Task`, `StepResult`, the `Environment` protocol, `call` for
plain or async methods, the checks on what a user's environment returned); `tools` the
function-calling schemas, the tool-call parsers and `ToolEnvironment`; `loader` builds the
environment `rollout.env` names; `skyrl` and `trl` adapt skyrl-gym's and TRL's
environments to the interface. See docs/environments.md.
"""
