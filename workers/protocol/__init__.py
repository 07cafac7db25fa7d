"""What crosses a process boundary, torch-free, below everything else: the messages (msgspec
structs), sampling parameters, logprobs, and the errors a request can end with. The gateway, the
recipe and the engine all import it, and it imports none of them."""
