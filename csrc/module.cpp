// fgfw._C has no Python functions: importing it loads this shared object, whose static
// initialisers (TORCH_LIBRARY in ops.cpp, TORCH_LIBRARY_IMPL in cpu/ and cuda/) register the ops
// as torch.ops.fgfw.*. Import torch first: the object has no RUNPATH to torch's libraries.
#include <Python.h>

PyMODINIT_FUNC PyInit__C() {
  static PyModuleDef module{
      .m_base = PyModuleDef_HEAD_INIT,
      .m_name = "fgfw._C",
      .m_doc = "fgfw's compiled kernels; importing this module registers torch.ops.fgfw.",
      .m_size = -1,
      .m_methods = nullptr,
      .m_slots = nullptr,
      .m_traverse = nullptr,
      .m_clear = nullptr,
      .m_free = nullptr,
  };
  return PyModule_Create(&module);
}
