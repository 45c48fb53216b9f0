"""The in-process engine, for strategy tests and trying idmint out: cas.py (cells, hence
segment keys over them) and leases.py (worker leases in a dict)."""
