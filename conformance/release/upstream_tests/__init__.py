"""vLLM's own scheduler tests, run on a subject's classes (the machinery of
``omni-conformance upstream-tests``, whose command is ``conformance.cli.upstream_tests``).

One module per concern: ``fetch`` (the release's tests from its sdist, cached, and the model
stand-ins), ``selection`` (which test files run), ``run`` (a child pytest with the subject's
classes swapped in, or upstream's own as the baseline) and ``outcomes`` (JUnit outcomes, the
comparison with the baseline, the ``--json`` document). The pytest plugin that swaps the classes
is ``conformance.release.upstream_swap``. This package re-exports what its users call.
"""

from conformance.release.upstream_tests.fetch import (
    CACHE_ENV,
    CachedTests,
    TestsUnavailable,
    cached,
    default_cache_dir,
    ensure_tests,
)
from conformance.release.upstream_tests.outcomes import (
    Verdict,
    compare,
    counts,
    module_paths,
    parse_junit,
    result_json,
)
from conformance.release.upstream_tests.run import (
    DEFAULT_TIMEOUT_S,
    Run,
    RunProblem,
    is_upstream,
    run_pytest,
)
from conformance.release.upstream_tests.selection import (
    SCHEDULER_SELECTION,
    SLOW_MODULES,
    select_tests,
)

__all__ = [
    "CACHE_ENV",
    "DEFAULT_TIMEOUT_S",
    "SCHEDULER_SELECTION",
    "SLOW_MODULES",
    "CachedTests",
    "Run",
    "RunProblem",
    "TestsUnavailable",
    "Verdict",
    "cached",
    "compare",
    "counts",
    "default_cache_dir",
    "ensure_tests",
    "is_upstream",
    "module_paths",
    "parse_junit",
    "result_json",
    "run_pytest",
    "select_tests",
]
