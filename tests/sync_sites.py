"""Where a host sync of a CUDA step comes from (tests/test_gpu.py's host-sync test; replayed on the CPU by
tests/test_sync_sites.py): the innermost Python frame of the call that synchronised. Inside megamemo's package
(resolved against megamemo.__file__, whatever the checkout's folder is called) it is megamemo's own sync, named
`<path below the package>:<function>`; anywhere else (DeepSpeed, torch, site-packages) it is a library's,
named "outside megamemo" with the megamemo call site it came from."""
from __future__ import annotations

import os


def package_root() -> str:
    import megamemo

    return os.path.dirname(os.path.realpath(megamemo.__file__)) + os.sep


def attribute(stack, root: str) -> tuple[str, str | None]:
    """(site, caller) of a sync whose Python stack (traceback.extract_stack(), innermost last) is `stack`: site is
    megamemo's own `path:function` or "outside megamemo"; caller is the innermost megamemo frame of a library's
    sync (None for megamemo's own or when no megamemo frame is on the stack)."""
    def own(frame) -> str | None:
        path = os.path.realpath(frame.filename)
        if not path.startswith(root) or f"{os.sep}site-packages{os.sep}" in os.sep + path[len(root):]:
            return None
        return f"{os.path.relpath(path, root)}:{frame.name}"

    if not stack:
        return "outside megamemo", None
    site = own(stack[-1])
    if site is not None:
        return site, None
    callers = [s for s in map(own, stack) if s is not None]
    return "outside megamemo", (callers[-1] if callers else None)
