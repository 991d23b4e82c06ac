"""omni_runtime: an autoregressive runtime for omni stages built on upstream vLLM v1.

The runtime extends vLLM's scheduler and worker through subclasses plugged into vLLM's own
``EngineCore``; see ``DESIGN.md`` for the layering (``engine`` > ``sched`` / ``worker`` >
``adapters`` > ``payload`` / ``config``; ``models`` uses torch only).
"""

__version__ = "0.1.0"
