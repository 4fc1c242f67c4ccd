"""Imported by ``run_on_ranks``' fork server and nowhere else: imports ``PRELOAD`` once, so that every rank forked
from the server starts with it imported (boundpass/testing/distributed.py)."""
from boundpass.testing.distributed import PRELOAD, preload

preload(PRELOAD)
