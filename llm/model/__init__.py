from llm.model.token_losses import masked_cross_entropy
from llm.model.transformer import ModelOutput, Transformer

__all__ = ["ModelOutput", "Transformer", "masked_cross_entropy"]
