"""The gate's core, private to this package: subjects and capabilities, workloads and the state
machines that draw them, lock-step sessions, drivers, observation and comparison, replay and
shrinking, the report, and the one module (``vllm_compat``) that reads vLLM's private state.
Adopters import ``conformance.api`` instead. See docs/design.md."""
