"""What a Hugging Face model folder says (config, tokenizer, chat template), read without
torch: the router and the engine both import it, and the router never imports the engine."""
