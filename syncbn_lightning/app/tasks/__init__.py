"""Training tasks of the Hydra service: a COCO-format detection datamodule with a synthetic shapes
generator, a compact CenterNet detector and a small classifier, all with BatchNorm, and COCO mAP.

These sit above the Lightning layer (they import Lightning, never Hydra); ``train.py`` and
``conf/`` build them with ``hydra.utils.instantiate``.
"""
