"""Drafters that need no drafter family of their own: a small independent draft model (draft_model),
prompt lookup (prompt_lookup) and early exit from the target's own lower blocks (early_exit). Each
implements verify.loop's Drafter protocol; may import verify.common, plan, training, backends and loop."""
