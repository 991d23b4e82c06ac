"""The gate on a Ray cluster: ``check --ray`` (the suite as shards, ``ray_check``) and
``matrix --ray`` (each cell a task, ``ray_matrix``). Ray is imported only when a command asks for
a cluster. How to point them at a cluster: docs/cluster.md."""
