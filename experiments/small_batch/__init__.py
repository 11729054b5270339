"""The small-batch detection experiment: what SyncBN, its group size, GroupNorm, a frozen
pretrained backbone and PreciseBN buy, and where more images per normalization stop helping.

``python -m experiments.small_batch`` trains, for every seed, the ``detection_*`` recipe family of
the training service on the harder synthetic shapes (``data=shapes_hard``), all variants in
:data:`.variants.VARIANTS`:

* ``local_bn``, ``group2``, ``syncbn``: 4 processes x 2 images, BatchNorm over 2, 4 or 8 images
  (local, SyncBN in groups of 2 ranks, SyncBN over all 4);
* ``large_batch``: 1 process x 8 images, plain BatchNorm (the large-batch reference);
* ``local_bn_b8``, ``group2_b8``, ``syncbn_b8``: the same at 4 x 8 images (8, 16, 32 per
  normalization; global batch 32, same epochs, so a quarter of the steps);
* ``gn``: 4 x 2 with GroupNorm;
* ``pre_frozen``, ``pre_local_bn``, ``pre_syncbn``: 4 x 2 from the same seed's pretrained backbone
  (``recipe=backbone_pretrain``), with frozen BN, local BN or SyncBN over the world.

The global-batch-8 variants share the learning rate, steps, initialization and data order (the
same 8 images at every optimizer step; see ``CocoDataModule``). Every detector is evaluated three
ways on the same final weights: with the EMA running statistics training kept, with PreciseBN
population statistics, and with the statistics of each validation batch (a probe of how much the
normalization statistics matter on this task). See :mod:`.runner`, :mod:`.analysis` and
:mod:`.choice` (the knee of the norm-batch sweep); :mod:`.cost` profiles where a job's time goes.
"""
