"""Training: data (`data`), tokenizer (`tokenizer`), the LM trainer (`lm`), export (`export`),
function-preserving growth of a trained model (`grow`)."""
