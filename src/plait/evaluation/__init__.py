"""Benchmarks of lm-evaluation-harness on plait models, in every tensor-parallel layout.

- :mod:`~plait.evaluation.scoring`: log-likelihoods of token continuations and of whole documents
  (rolling windows) through the model's own forward, the one the trainer runs; no lm-eval import;
- :mod:`~plait.evaluation.lm_eval_model`: the ``plait`` model of lm-eval (``PlaitLM``), which
  tokenizes as lm-eval's Hugging Face backend does and scores with the functions above, and
  generates with the KV-cache engine (:mod:`plait.inference`);
- :mod:`~plait.evaluation.harness`: task names checked (close matches named), tasks run, metrics
  read back as rows;
- :mod:`~plait.evaluation.run`: one evaluation of a model directory, in one process or over local
  tensor-parallel ranks, for ``plait eval MODEL --lm-eval TASK``;
- :mod:`~plait.evaluation.errors`: ``LmEvalError``, the user errors.

lm-eval is imported only by ``lm_eval_model`` and ``harness``, and only when they are imported: ``plait`` itself and
``plait --help`` never load it. See docs/evaluation.md.
"""
