"""Training: data (`data`), tokenizer (`tokenizer`), the LM trainer (`lm`), export (`export`)."""
