"""Release tooling built on the gate's core: per-release environments (``envs``), the
compatibility matrix and its merged report (``matrix``, ``matrix_cells``, ``matrix_report``),
recorded corpora and the diff between releases (``record``, ``release_diff``), and vLLM's own
scheduler tests run with a subject's classes (``upstream_tests``, ``upstream_swap``).
See docs/compat-matrix.md."""
