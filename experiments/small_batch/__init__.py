"""The small-batch detection experiment: what SyncBN, its group size and PreciseBN buy.

``python -m experiments.small_batch`` trains, for every seed, the ``detection_*`` recipe family of
the training service on the harder synthetic shapes (``data=shapes_hard``):

* ``local_bn``: 4 processes x 2 images, BatchNorm over each process's 2 images,
* ``syncbn``: 4 x 2, SyncBN over all 4 ranks (8 images per normalization),
* ``group2``: 4 x 2, SyncBN in groups of 2 ranks (4 images),
* ``large_batch``: 1 process x 8 images, plain BatchNorm (the large-batch reference),

all with the same global batch (8), learning rate, steps, initialization and data order (the
same 8 images at every optimizer step; see ``CocoDataModule``). Every run is evaluated three
ways on the same final weights: with the EMA running statistics training kept, with PreciseBN
population statistics, and with the statistics of each 2-image validation batch (a probe of how
much the normalization statistics matter on this task). See :mod:`.runner` and :mod:`.analysis`.
"""
