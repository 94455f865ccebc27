"""Built-in environments, one package each; only `steprl.envs.registry` imports them."""
