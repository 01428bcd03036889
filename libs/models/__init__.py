"""Model files: a GGUF's card (``gguf_info``), the cluster's model registry (``registry``), what
each engine runs (``engine_support``), the shipped model (``shipped``), files downloaded from a
URL or the Hugging Face hub (``hub``) and chat prompts (``chat``). Moving weights between hosts
is ``libs/weights``; the torch engine's pieces are the torch worker's
(``services/worker/torch``)."""
