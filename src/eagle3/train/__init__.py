"""Training EAGLE-3 heads with training-time test (TTT): data, vocabulary, loss, trainer."""
