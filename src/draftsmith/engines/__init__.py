"""External serving engines draftsmith drives to evaluate and ship its drafters (llama.cpp's `llama-server`)."""
