"""Subject adapters for published runtimes the harness checks but does not ship."""
