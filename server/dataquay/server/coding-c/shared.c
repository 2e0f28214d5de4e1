/* What every pass's function does with its arguments: takes their buffers as
 * int64 arrays, and releases them and sets the error of its run. */
#include "coding.h"

static int
is_int64(const Py_buffer *view)
{
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    return view->itemsize == 8 && f[0] && !f[1] && strchr("qQlL", f[0]) != NULL;
}

/* Takes the buffers of args[0..nargs) (those from `writable` on writable),
 * each C-contiguous 64-bit integers; on failure sets the error and releases
 * what it took. */
int
dq_coding_get_views(const char *name, PyObject *const *args, Py_ssize_t nargs, int expected, int writable,
                    Py_buffer *views)
{
    int got = 0;
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s takes %d arrays, not %zd", name, expected, nargs);
        return -1;
    }
    for (; got < expected; got++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (got >= writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(args[got], &views[got], flags) < 0)
            break;
        if (!is_int64(&views[got])) {
            PyErr_Format(PyExc_ValueError, "%s's array %d is not of 64-bit integers", name, got);
            got++;
            break;
        }
    }
    if (got == expected && !PyErr_Occurred())
        return 0;
    while (got--)
        PyBuffer_Release(&views[got]);
    return -1;
}

static void
release_views(Py_buffer *views, int count)
{
    while (count--)
        PyBuffer_Release(&views[count]);
}

/* Sets the error of a run: -1 out of memory, 0 the message, 1 none. */
PyObject *
dq_coding_finish(int done, const char *error, Py_buffer *views, int count, PyObject *result)
{
    release_views(views, count);
    if (done < 0)
        PyErr_NoMemory();
    else if (!done)
        PyErr_SetString(PyExc_ValueError, error);
    if (done <= 0) {
        Py_XDECREF(result);
        return NULL;
    }
    return result;
}
