"""The heads' data set, one path from prompts to disk (`experiments/make_head_data.py`
runs it)::

    prompts         the built-in prompt set, the user's prompt files, the seeded split
    self_instruct   more prompts, written by the model itself
    capture         the model's answers with the hidden states heads read, batched
    dataset         the data set on disk: chunks written as capture yields rows, read back
    make            the whole path, resumable, inside a budget
"""
