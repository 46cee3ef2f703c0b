"""Makes `lm_eval --model megamemo` work: lm-eval 0.4.x finds models only in its own table (lm_eval/models/__init__.py,
MODEL_MAPPING, registered lazily as "module:Class" strings when lm_eval.models is imported) and has no plugin
discovery for them (the entry-point mechanism came after 0.4.13). So a one-line .pth file in site-packages adds an
import hook that, right after lm_eval.models has registered its own models, registers "megamemo" the same lazy way
(-> megamemo.export.harness:MegamemoLM, imported only when that model is asked for).

    python -m megamemo.export.lm_eval_plugin install [SITE_DIR]     (scripts/setup.sh runs it)

The hook is written into the .pth itself, so it imports nothing of megamemo at interpreter start (a Python that
cannot import megamemo is unaffected) and costs one string comparison per import until lm_eval.models is loaded.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from megamemo.util.files import write_text_atomic

PTH_NAME = "megamemo-lm-eval.pth"
TARGET = "megamemo.export.harness:MegamemoLM"

HOOK = f'''
import sys, importlib.abc, importlib.util
class _MegamemoLmEval(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "lm_eval.models":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            from lm_eval.api.registry import model_registry
            if "megamemo" not in model_registry:
                model_registry.register("megamemo", target="{TARGET}")
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, _MegamemoLmEval())
'''


def pth_line() -> str:
    """The .pth line: site.py executes lines that start with `import`."""
    return f"import sys; exec({HOOK!r}, {{'__name__': 'megamemo_lm_eval_hook'}})\n"


def install(site_dir: str | None = None) -> Path:
    path = Path(site_dir or sysconfig.get_paths()["purelib"]) / PTH_NAME
    write_text_atomic(path, pth_line(), durable=False)
    return path


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "install":
        sys.exit("usage: python -m megamemo.export.lm_eval_plugin install [SITE_DIR]")
    print(f"[lm-eval] model 'megamemo' registered for the lm_eval command: {install(*sys.argv[2:3])}")
