"""The training service from a clone: ``python train.py [group=option ...] [key=value ...]``.

The same as the installed ``syncbn-train`` command (``pip install "syncbn_lightning[app]"``); the
service lives in :mod:`syncbn_lightning.app`, its configs in ``conf/``.

Examples::

    python train.py                      # detection, 2 CPU processes, SyncBN, W&B offline
    python train.py trainer.devices=4 bn.group_size=2
    python train.py -m bn.group_size=1,2,4 trainer.devices=4   # three jobs, one W&B run each
    python train.py recipe=detection_local_bn          # a baseline
    python train.py --cfg job                          # print the composed config, run nothing
"""

from syncbn_lightning.app.cli import entry

if __name__ == "__main__":
    entry()
