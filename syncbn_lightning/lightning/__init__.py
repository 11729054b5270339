"""Lightning: :class:`~syncbn_lightning.SyncBNCallback` (:mod:`.callback`, with what it measures and
logs in :mod:`.monitoring`), the :class:`~syncbn_lightning.SyncBNLayerSync` plugin
(:mod:`.layer_sync`) and what both do to the DDP strategy (:mod:`.ddp_setup`). The only part of
the library that imports Lightning (the ``[lightning]`` extra): ``import syncbn_lightning`` loads
it on first use of those two names.
"""
