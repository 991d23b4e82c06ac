"""Planted broken schedulers (positive controls): every invariant must catch at least one."""
