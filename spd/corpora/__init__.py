"""Text the suite reads besides the request: the evaluation prompts, the packaged ShareGPT records, and the
datastores a drafter retrieves continuations from."""
