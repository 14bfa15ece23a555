"""Medusa heads and sequential heads: drafters that read the frozen base's last hidden state.

heads (MedusaHeads; FrozenHead, the base's borrowed embedding and output layer), trees (static trees of head
ranks), drafter (PositionDrafter: chains and static trees from K per-position distributions; MedusaDrafter),
train (build, loss, evaluate on a FeatureBatch); sequential, sequential_drafter, sequential_train: the heads
that also read the tokens drafted before them. Builds on verify/ only.
"""
