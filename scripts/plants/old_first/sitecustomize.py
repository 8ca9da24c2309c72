"""A planted error for `scripts/stress.sh` (STRESS_PLANT=old_first): a save removes the previous checkpoint before its
own metadata and manifest are written, so a crash in between leaves no whole checkpoint.
`tests/safety/test_checkpoint_faults.py` must fail with it. Python imports this at every interpreter's start where its
folder is on PYTHONPATH, the save loop's processes too."""

import json
import os
import shutil

from strategies.checkpoint import sharded


def _finish(path, tmp, token, skeleton, manifest):
    if os.path.lexists(path):
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    manifest["files"][sharded.META] = sharded._write(skeleton, os.path.join(tmp, sharded.META))
    sharded.atomic_write(os.path.join(tmp, sharded.MANIFEST), lambda f: json.dump(manifest, f))
    os.replace(tmp, path)


sharded._finish = _finish
