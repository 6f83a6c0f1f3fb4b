"""torch's face: torch.distributed's API on gpucomm's Communicators.

- :mod:`~gpucomm.distributed.world`: the default world's lifecycle (``init_process_group``,
  ``destroy_process_group``, ``get_rank``, ...);
- :mod:`~gpucomm.distributed.groups`: group construction (``new_group``, ``split_group``, ...);
- :mod:`~gpucomm.distributed.collectives`, :mod:`~gpucomm.distributed.objects`: the collectives
  on tensors and on picklable objects;
- :mod:`~gpucomm.distributed.torch_names`: the rest of torch.distributed's public names;
- :mod:`~gpucomm.distributed.lookup`: how a call finds its group's Communicator;
- :mod:`~gpucomm.distributed.one_world`, :mod:`~gpucomm.distributed.beside_torch`: the two ways
  gpucomm's world stands to torch's, chosen once at init;
- :mod:`~gpucomm.distributed.arguments`: torch's arguments in gpucomm's terms;
- :mod:`~gpucomm.distributed.backend`, :mod:`~gpucomm.distributed.torch_work`,
  :mod:`~gpucomm.distributed.registration`: the ``gpucomm`` torch.distributed backend.

``gpucomm/__init__.py`` re-exports the public modules' ``__all__``.
"""
