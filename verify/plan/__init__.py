"""Budgets (budget): the draft length or tree size a drafter should use, chosen from measured verify and
draft costs and measured acceptance. Pure arithmetic on those figures; may import verify.common only."""
