"""How good a model is: perplexity and bits per byte on text (`perplexity`, over a `token_stream`), benchmark
suites through lm-evaluation-harness (`harness`), and how much a recipe learns in a fixed time (`learning_speed`)."""
