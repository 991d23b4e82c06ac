"""omni_runtime: an autoregressive runtime for omni stages built on upstream vLLM v1.

The runtime extends vLLM's scheduler and worker through subclasses plugged into vLLM's own
``EngineCore``. Layering: ``engine`` > ``sched`` / ``worker`` > ``adapters`` > ``payload`` /
``config``; ``models`` uses torch only (``import_contracts.toml`` holds the rules).
"""

__version__ = "0.1.0"
