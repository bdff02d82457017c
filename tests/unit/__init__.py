"""Single-process tests of the drop-in API against upstream: options, errors, wrappers, optimizers, module and optimizer corpora, deviations."""
