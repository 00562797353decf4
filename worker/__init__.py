"""Inside each Ray actor: device and communication init, the network, KV cache, compiled steps, sampler."""
