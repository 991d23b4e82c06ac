"""The child-process side of ``PipeConnector``: forwards bytes from one pipe to another.

Kept free of torch and vLLM imports so a spawned relay starts in well under a second.
"""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection
from queue import Queue


def relay_main(inbox: Connection, outbox: Connection) -> None:
    """Forward every message from ``inbox`` to ``outbox`` until ``inbox`` reaches EOF."""
    q: Queue[bytes | None] = Queue()

    def reader() -> None:
        # Reads greedily into an unbounded queue so the sender never blocks on a full pipe.
        try:
            while True:
                q.put(inbox.recv_bytes())
        except (EOFError, OSError):
            q.put(None)

    threading.Thread(target=reader, daemon=True).start()
    while True:
        item = q.get()
        if item is None:
            break
        outbox.send_bytes(item)
    outbox.close()
