/* The module dataquay.server._coding: its method table and its init. */
#include "coding.h"

static PyMethodDef methods[] = {
    {"greedy", (PyCFunction)(void (*)(void))dq_coding_greedy, METH_FASTCALL, dq_coding_greedy_doc},
    {"packet_rows", (PyCFunction)(void (*)(void))dq_coding_packet_rows, METH_FASTCALL, dq_coding_packet_rows_doc},
    {"pick_bits", (PyCFunction)(void (*)(void))dq_coding_pick_bits, METH_FASTCALL, dq_coding_pick_bits_doc},
    {"table_hashes", (PyCFunction)(void (*)(void))dq_coding_table_hashes, METH_FASTCALL, dq_coding_table_hashes_doc},
    {"set_numbers", (PyCFunction)(void (*)(void))dq_coding_set_numbers, METH_FASTCALL, dq_coding_set_numbers_doc},
    {"dag_edges", (PyCFunction)(void (*)(void))dq_coding_dag_edges, METH_FASTCALL, dq_coding_dag_edges_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef coding_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dataquay.server._coding",
    .m_doc = "The loops of dataquay.server.node.exchange.coding's planner, in C.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__coding(void)
{
    return PyModuleDef_Init(&coding_module);
}
