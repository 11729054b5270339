"""Who talks to whom, and how: process groups and group-size rules (:mod:`.groups`), every
collective call of the library (:mod:`.collectives`), the call-order check that makes a mismatched
forward an error instead of a silent merge (:mod:`.call_order`), and the in-process exchange of
``nn.DataParallel`` replicas (:mod:`.replicas`). Imports torch only.
"""
