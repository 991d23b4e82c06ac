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
    CORE_DIR,
    FETCH_TIMEOUT_S,
    MODELS_ASSET,
    SOURCE_FILE,
    CachedTests,
    TestsUnavailable,
    cached,
    default_cache_dir,
    ensure_tests,
    pip_download,
    release_dir,
    select_files,
    write_cache,
    write_models,
)
from conformance.release.upstream_tests.outcomes import (
    OUTCOMES,
    Verdict,
    compare,
    counts,
    module_paths,
    nodeid_of,
    not_passing,
    parse_junit,
    result_json,
)
from conformance.release.upstream_tests.run import (
    DEFAULT_TIMEOUT_S,
    PLUGIN,
    Run,
    RunProblem,
    child_env,
    is_upstream,
    pytest_command,
    run_pytest,
)
from conformance.release.upstream_tests.selection import (
    SCHEDULER_SELECTION,
    SLOW_MODULES,
    builds_scheduler,
    select_tests,
)

__all__ = [
    "CACHE_ENV",
    "CORE_DIR",
    "DEFAULT_TIMEOUT_S",
    "FETCH_TIMEOUT_S",
    "MODELS_ASSET",
    "OUTCOMES",
    "PLUGIN",
    "SCHEDULER_SELECTION",
    "SLOW_MODULES",
    "SOURCE_FILE",
    "CachedTests",
    "Run",
    "RunProblem",
    "TestsUnavailable",
    "Verdict",
    "builds_scheduler",
    "cached",
    "child_env",
    "compare",
    "counts",
    "default_cache_dir",
    "ensure_tests",
    "is_upstream",
    "module_paths",
    "nodeid_of",
    "not_passing",
    "parse_junit",
    "pip_download",
    "pytest_command",
    "release_dir",
    "result_json",
    "run_pytest",
    "select_files",
    "select_tests",
    "write_cache",
    "write_models",
]
