"""Built-in environments. Each is registered by `import agentrl` under `agentrl/<Name>-v<N>`."""
