"""Devices: the `data` x `expert` mesh, the logical axis rules that place every array on it
(`sharding`), and the start-up of a multi-process run (`distributed`)."""
