"""What an exported Hugging Face folder ships: the model's code (modeling_attnres.py) and the byte
tokenizer (tokenization_attnres.py). Both files are copied into the folder as they are, so they import
nothing of the project but `attnres`, and the tokenizer not even that."""
