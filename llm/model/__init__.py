from llm.model.transformer import ModelOutput, Transformer, masked_cross_entropy

__all__ = ["ModelOutput", "Transformer", "masked_cross_entropy"]
