/* kv_aware's cost refit in C: `kvrouter.routing.calibration.fit_costs` without a Python-level step per row.
 *
 * The fit is the iteratively reweighted least-absolute-deviation solve of calibration.py (`python_fit_costs`, kept
 * there as the reference and the fallback), and it must give the same floats bit for bit: the replay's figures and
 * the router's decisions depend on every fitted value. So every double operation below is the one CPython performs
 * for the Python code, in the same order:
 *
 * - `sum(...)` starts from the int 0, so its first float is `0.0 + x`; then CPython 3.11 adds left to right, and
 *   3.12 and later add with Neumaier's compensation (`py_sum`, chosen at compile time from the headers' version);
 * - `x ** 2` is CPython's float_pow: its special cases, then the C library's `pow(x, 2.0)` with its errno check
 *   (`py_square`; the exponent is read through a volatile so the compiler cannot turn the call into x * x);
 * - `max(a, b)` and `min(a, b)` keep the first argument unless the second is strictly greater (smaller), and
 *   `max(range, key=...)` keeps the first maximum; `math.sqrt(v) or 1.0` replaces a zero;
 * - the median target `sorted(targets)[count // 2]` only feeds `max(1e-4, 1e-3 * typical)`, where a -0.0 and a
 *   0.0 give the same floor, so a selection stands in for the sort.
 *
 * Built with -ffp-contract=off (no fused multiply-add) and never with -ffast-math, which would change bits.
 *
 * What it does not take it declines (returns False) and the caller runs the Python fit: inputs that are not
 * plain floats (an int is taken where Python converts it to a float before any arithmetic), a NaN TTFT (Python's
 * sort of NaNs is timsort's own order), anything Python raises on (a zero prefill rate, an overflowing square).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <math.h>
#include <string.h>

#if defined(__FAST_MATH__)
#error "kvrouter/_costfit.c must not be built with -ffast-math: the fit must match Python's bit for bit"
#endif
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#define DECLINE 1 /* not an error: the Python fit runs instead */
#define FITTED 2

static PyObject *name_short, *name_passes, *name_decoding, *name_work_tokens, *name_ttft_s;

/* Python's sum() over floats with the int 0 as start (n == 0: the int 0, which acts as 0.0 here). */
static double py_sum(const double *terms, Py_ssize_t n) {
    if (n == 0)
        return 0.0;
    double total = 0.0 + terms[0];
#if PY_VERSION_HEX >= 0x030C0000
    double c = 0.0;
    for (Py_ssize_t i = 1; i < n; i++) {
        double x = terms[i];
        double t = total + x;
        if (fabs(total) >= fabs(x))
            c += (total - t) + x;
        else
            c += (x - t) + total;
        total = t;
    }
    if (c != 0.0 && isfinite(c))
        total += c;
#else
    for (Py_ssize_t i = 1; i < n; i++)
        total += terms[i];
#endif
    return total;
}

static volatile double square_exponent = 2.0;

/* CPython's float_pow(x, 2.0); DECLINE where it raises (OverflowError). */
static int py_square(double x, double exponent, double *out) {
    if (isnan(x)) {
        *out = x;
        return 0;
    }
    if (isinf(x)) {
        *out = fabs(x);
        return 0;
    }
    if (x == 0.0) {
        *out = 0.0;
        return 0;
    }
    if (x < 0.0)
        x = -x;
    if (x == 1.0) {
        *out = 1.0;
        return 0;
    }
    errno = 0;
    double r = pow(x, exponent);
    if (errno == 0) {
        if (r == HUGE_VAL || r == -HUGE_VAL)
            errno = ERANGE;
    } else if (errno == ERANGE && r == 0.0) {
        errno = 0;
    }
    if (errno != 0)
        return DECLINE;
    *out = r;
    return 0;
}

/* A plain float, or an int that Python would convert to one before any arithmetic with a float. */
static int as_double(PyObject *value, double *out) {
    if (PyFloat_CheckExact(value)) {
        *out = PyFloat_AS_DOUBLE(value);
        return 0;
    }
    if (PyLong_CheckExact(value)) {
        double d = PyLong_AsDouble(value);
        if (d == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            return DECLINE;
        }
        *out = d;
        return 0;
    }
    return DECLINE;
}

static int plain_float(PyObject *value, double *out) {
    if (!PyFloat_CheckExact(value))
        return DECLINE;
    *out = PyFloat_AS_DOUBLE(value);
    return 0;
}

/* An attribute as a plain float (`as_int`: an exact int too); DECLINE for anything else. */
static int attribute(PyObject *object, PyObject *name, double *out, int *is_int) {
    PyObject *value = PyObject_GetAttr(object, name);
    if (value == NULL) {
        PyErr_Clear();
        return DECLINE;
    }
    int status;
    if (is_int != NULL && PyLong_CheckExact(value)) {
        *is_int = 1;
        status = as_double(value, out);
    } else {
        if (is_int != NULL)
            *is_int = 0;
        status = plain_float(value, out);
    }
    Py_DECREF(value);
    return status;
}

/* The element of rank k (0-based) of values[0..n) in ascending order; values are reordered, none is NaN. */
static double select_rank(double *values, Py_ssize_t n, Py_ssize_t k) {
    Py_ssize_t lo = 0, hi = n - 1;
    while (lo < hi) {
        double pivot = values[lo + (hi - lo) / 2];
        Py_ssize_t i = lo, j = hi;
        while (i <= j) {
            while (values[i] < pivot)
                i++;
            while (pivot < values[j])
                j--;
            if (i <= j) {
                double swap = values[i];
                values[i] = values[j];
                values[j] = swap;
                i++;
                j--;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            break;
    }
    return values[k];
}

/* _gauss: Gaussian elimination with partial pivoting on an n x n system (n <= 3), in place; -1 if singular. */
static int gauss(double matrix[3][3], double vector[3], int size, double solution[3]) {
    for (int column = 0; column < size; column++) {
        int pivot = column;
        double best = fabs(matrix[column][column]);
        for (int row = column + 1; row < size; row++) {
            double candidate = fabs(matrix[row][column]);
            if (candidate > best) {
                best = candidate;
                pivot = row;
            }
        }
        if (fabs(matrix[pivot][column]) < 1e-300)
            return -1;
        if (pivot != column) {
            double row_swap[3];
            memcpy(row_swap, matrix[column], sizeof(row_swap));
            memcpy(matrix[column], matrix[pivot], sizeof(row_swap));
            memcpy(matrix[pivot], row_swap, sizeof(row_swap));
            double swap = vector[column];
            vector[column] = vector[pivot];
            vector[pivot] = swap;
        }
        for (int row = column + 1; row < size; row++) {
            double factor = matrix[row][column] / matrix[column][column];
            for (int k = column; k < size; k++)
                matrix[row][k] -= factor * matrix[column][k];
            vector[row] -= factor * vector[column];
        }
    }
    for (int row = size - 1; row >= 0; row--) {
        double terms[3];
        int count = 0;
        for (int k = row + 1; k < size; k++)
            terms[count++] = matrix[row][k] * solution[k];
        double rest = py_sum(terms, count);
        solution[row] = (vector[row] - rest) / matrix[row][row];
    }
    return 0;
}

/* _solve_nonnegative: weighted least squares, a negative coefficient pinned at 0 and the rest refit. */
static int solve_nonnegative(double *const columns[3], const double *targets, const double *weights, Py_ssize_t rows,
                             double beta[3]) {
    int free_columns[3] = {0, 1, 2};
    int size = 3;
    while (size > 0) {
        double matrix[3][3] = {{0.0}}, vector[3] = {0.0}, solution[3] = {0.0};
        /* X'WX and X'Wy, each entry summed row by row in row order (_normal_equations). */
        for (Py_ssize_t i = 0; i < rows; i++) {
            double y = targets[i], w = weights[i];
            for (int a = 0; a < size; a++) {
                double wx = w * columns[free_columns[a]][i];
                vector[a] += wx * y;
                for (int b = 0; b < size; b++)
                    matrix[a][b] += wx * columns[free_columns[b]][i];
            }
        }
        if (gauss(matrix, vector, size, solution) < 0)
            return -1;
        int kept = 0, next[3];
        for (int a = 0; a < size; a++)
            if (!(solution[a] < 0))
                next[kept++] = free_columns[a];
        if (kept == size) {
            beta[0] = beta[1] = beta[2] = 0.0;
            for (int a = 0; a < size; a++)
                beta[free_columns[a]] = solution[a];
            return 0;
        }
        memcpy(free_columns, next, sizeof(next));
        size = kept;
    }
    beta[0] = beta[1] = beta[2] = 0.0;
    return 0;
}

/* The fit on arrays (x0, x1, x2, y, m, w each of n + 3 doubles): FITTED (out[3]), 0 (None) or DECLINE. */
static int fit_arrays(double *const x[3], double *y, double *m, double *w, double *scratch, Py_ssize_t n,
                      const double prior_beta[3], double prior_samples, Py_ssize_t iterations, double out[3]) {
    double exponent = square_exponent;
    double scales[3];
    for (int j = 0; j < 3; j++) {
        for (Py_ssize_t i = 0; i < n; i++)
            if (py_square(x[j][i], exponent, &scratch[i]) == DECLINE)
                return DECLINE;
        double scale = sqrt(py_sum(scratch, n) / (double)n);
        scales[j] = scale != 0.0 ? scale : 1.0;
    }
    for (int j = 0; j < 3; j++)
        for (Py_ssize_t i = 0; i < n; i++)
            x[j][i] = x[j][i] / scales[j];
    double prior_scaled[3];
    for (int j = 0; j < 3; j++)
        prior_scaled[j] = prior_beta[j] * scales[j];
    memcpy(scratch, y, (size_t)n * sizeof(double));
    double tenth = 1e-3 * select_rank(scratch, n, n / 2);
    double floor = tenth > 1e-4 ? tenth : 1e-4;
    Py_ssize_t rows = n;
    for (Py_ssize_t i = 0; i < n; i++)
        m[i] = 1.0;
    if (prior_samples > 0) {
        for (int j = 0; j < 3; j++) {
            for (int k = 0; k < 3; k++)
                x[k][rows] = k == j ? 1.0 : 0.0;
            y[rows] = prior_scaled[j];
            m[rows] = prior_samples;
            rows++;
        }
    }
    double beta[3] = {prior_scaled[0], prior_scaled[1], prior_scaled[2]};
    memcpy(w, m, (size_t)rows * sizeof(double));
    for (Py_ssize_t iteration = 0; iteration < iterations; iteration++) {
        if (solve_nonnegative(x, y, w, rows, beta) < 0)
            return 0;
        double b0 = beta[0], b1 = beta[1], b2 = beta[2];
        for (Py_ssize_t i = 0; i < rows; i++) {
            double terms[3] = {x[0][i] * b0, x[1][i] * b1, x[2][i] * b2};
            double a = fabs(y[i] - py_sum(terms, 3));
            w[i] = m[i] / (floor > a ? floor : a);
        }
    }
    double pass_s = beta[0] / scales[0], per_request = beta[1] / scales[1], per_token = beta[2] / scales[2];
    if (!isfinite(pass_s) || !isfinite(per_request) || !isfinite(per_token))
        return 0;
    double rate;
    if (per_token <= 1.0 / 1e8) {
        rate = 1e8;
    } else {
        double inverse = 1.0 / per_token;
        double at_least = inverse > 100.0 ? inverse : 100.0;
        rate = at_least < 1e8 ? at_least : 1e8;
    }
    out[0] = rate;
    out[1] = pass_s < 2.0 ? pass_s : 2.0;
    out[2] = per_request < 0.1 ? per_request : 0.1;
    return FITTED;
}

static PyObject *py_fit(PyObject *module, PyObject *args) {
    /* fit(observations, pass_s, decode_s_per_request, prefill_tokens_per_s, prior_samples, iterations)
     *   -> (prefill_tokens_per_s, pass_s, decode_s_per_request) | None | False */
    PyObject *observations, *pass_obj, *decode_obj, *rate_obj, *samples_obj, *iterations_obj;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOOOOO:fit", &observations, &pass_obj, &decode_obj, &rate_obj, &samples_obj,
                          &iterations_obj))
        return NULL;
    if (!PySequence_Check(observations))
        Py_RETURN_FALSE;
    PyObject *fast = PySequence_Fast(observations, "observations must be a sequence");
    if (fast == NULL) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    double *memory = PyMem_Malloc((size_t)(7 * (n + 3)) * sizeof(double));
    if (memory == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    double *x[3] = {memory, memory + (n + 3), memory + 2 * (n + 3)};
    double *y = memory + 3 * (n + 3), *m = memory + 4 * (n + 3), *w = memory + 5 * (n + 3);
    double *scratch = memory + 6 * (n + 3);
    int status = 0;
    for (Py_ssize_t i = 0; i < n && status == 0; i++) {
        PyObject *o = items[i];
        double passes = 0.0, decoding = 0.0;
        int passes_int = 0, decoding_int = 0;
        status = attribute(o, name_short, &x[0][i], NULL);
        if (status == 0)
            status = attribute(o, name_passes, &passes, &passes_int);
        if (status == 0)
            status = attribute(o, name_decoding, &decoding, &decoding_int);
        if (status == 0 && passes_int && decoding_int)
            status = DECLINE; /* int * int stays an int in Python */
        if (status == 0)
            status = attribute(o, name_work_tokens, &x[2][i], NULL);
        if (status == 0)
            status = attribute(o, name_ttft_s, &y[i], NULL);
        if (status == 0 && isnan(y[i]))
            status = DECLINE;
        if (status == 0)
            x[1][i] = passes * decoding;
    }
    Py_DECREF(fast);
    PyObject *result = NULL;
    if (status != 0) {
        result = Py_NewRef(Py_False);
    } else if (n < 3) {
        result = Py_NewRef(Py_None);
    } else {
        double prior_beta[3], rate, prior_samples;
        Py_ssize_t iterations = PyLong_CheckExact(iterations_obj) ? PyLong_AsSsize_t(iterations_obj) : -1;
        if (iterations == -1 && PyErr_Occurred())
            PyErr_Clear();
        if (iterations < 0 || as_double(pass_obj, &prior_beta[0]) || as_double(decode_obj, &prior_beta[1]) ||
            as_double(rate_obj, &rate) || as_double(samples_obj, &prior_samples) || rate == 0.0) {
            result = Py_NewRef(Py_False);
        } else {
            prior_beta[2] = 1.0 / rate;
            double out[3];
            int fitted = fit_arrays(x, y, m, w, scratch, n, prior_beta, prior_samples, iterations, out);
            if (fitted == DECLINE)
                result = Py_NewRef(Py_False);
            else if (fitted == 0)
                result = Py_NewRef(Py_None);
            else
                result = Py_BuildValue("(ddd)", out[0], out[1], out[2]);
        }
    }
    PyMem_Free(memory);
    return result;
}

static PyMethodDef module_methods[] = {
    {"fit", py_fit, METH_VARARGS,
     "fit(observations, pass_s, decode_s_per_request, prefill_tokens_per_s, prior_samples, iterations)\n"
     "-> (prefill_tokens_per_s, pass_s, decode_s_per_request), None (the fit failed) or False (not taken:\n"
     "run the Python fit)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvrouter._costfit",
    .m_doc = "kv_aware's cost refit, bit for bit the Python fit.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__costfit(void) {
    if (name_short == NULL) {
        name_short = PyUnicode_InternFromString("short");
        name_passes = PyUnicode_InternFromString("passes");
        name_decoding = PyUnicode_InternFromString("decoding");
        name_work_tokens = PyUnicode_InternFromString("work_tokens");
        name_ttft_s = PyUnicode_InternFromString("ttft_s");
        if (!name_short || !name_passes || !name_decoding || !name_work_tokens || !name_ttft_s)
            return NULL;
    }
    return PyModule_Create(&module_def);
}
