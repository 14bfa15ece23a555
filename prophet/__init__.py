"""The prophet: a small x-transformers decoder fed the frozen base's features and token embeddings.

model (Prophet), drafter (autoregressive chains and EAGLE-2 dynamic trees on its own static cache), train
(teacher-forced and unrolled losses on a FeatureBatch); block, block_drafter, block_train: the same network
drafting a whole block of positions in one forward, with medusa's PositionDrafter for its chains and static
trees. Builds on verify/ and medusa/.
"""
