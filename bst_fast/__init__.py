"""bst_fast: the Belief State Transformer's all-pairs objective, fused on CPU (C++) and GPU (Triton)."""
from .head import TextHead
from .loss import BACKENDS, BeliefStateLoss, belief_state_loss

__all__ = ["TextHead", "belief_state_loss", "BeliefStateLoss", "BACKENDS"]
