"""The training pieces every drafter family shares: the batch a loss reads (features: FeatureBatch) and
self-distillation from the frozen base (distill: the loss, the agreement metric, the vocabulary subset's
index). Sits below medusa/ and prophet/ so that they need nothing from experiments/. May import
verify.common and verify.plan only."""
