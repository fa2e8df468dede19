/* Region-of-interest JPEG decoding with libjpeg-turbo (runner.data.decode._jpegregion).
 *
 * decode(data, denom, top, left, height, width) -> bytearray (height * width * 3, RGB)
 * decode_batch(items) -> [None or error message] per item
 *   (data, denom, top, left, height, width, dest, planar[, plane_stride, row_stride]):
 *   each window decoded straight into its destination buffer (a slot of the batch tensor:
 *   CHW planes, or a window of them with the strides in bytes, as a letterbox's picture
 *   inside its pads; or HWC), the whole batch in one call without the GIL (no Python
 *   between images).
 *
 * Decodes only the rows and columns of the window (top, left, height, width), given in
 * the coordinates of the image scaled by 1/denom (denom 1, 2, 4 or 8: libjpeg's fast DCT
 * scales). Rows above the window are skipped without the inverse DCT or colour conversion
 * (jpeg_skip_scanlines), rows below it are never read, and columns outside it are left
 * out of the inverse DCT and colour conversion (jpeg_crop_scanline, which widens the
 * window to whole iMCUs; the extra columns are dropped here). This is what DALI's CPU
 * decoder does for its random crops.
 *
 * Errors never exit the process: libjpeg's error_exit jumps back here and the call raises
 * ValueError. Warnings (a truncated file, corrupt data) are errors too, as simplejpeg's
 * strict mode treats them. The GIL is released while decoding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <jpeglib.h>

#define ROWS 16 /* at most, scanlines asked for per call */
/* The rows buffer is kept within about ROWS_BYTES, so a batch of scanlines is still in L1/L2
   when it is split into planes or copied. With 32 rows of a 640-wide picture (60 KB) the
   planar decode of a 480x640 JPEG took 1.14 ms a picture, with 16 (30 KB) 0.87: what the
   interleaved decode straight into place takes (0.83). Measured on the 2-core EPYC box. */
#define ROWS_BYTES 32768

struct region_error {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct region_error *err = (struct region_error *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    struct region_error *err = (struct region_error *)cinfo->err;
    if (level < 0) { /* a warning: corrupt or truncated data */
        (*cinfo->err->format_message)(cinfo, err->message);
        longjmp(err->jump, 1);
    }
}

/* Decode the window (top, left, height, width) of the image scaled by 1/denom into dst:
 * interleaved RGB rows (height x width x 3) or, with planar, three planes (a CHW image;
 * plane and row strides in bytes, so the planes may be a window of a larger image). A
 * window narrower than WHOLE_ROWS_FROM of the scaled width is cut
 * by jpeg_crop_scanline; a wider one is decoded in whole rows and cut here (libjpeg's
 * column crop costs more than it saves there). Returns 0, or 1 with problem set. Runs
 * without the GIL. */
#define WHOLE_ROWS_FROM 0.7

/* One row of interleaved RGB into three planes. Vectorized by the SSSE3/AVX2 clones (their
   byte shuffles): measured 8 us for a 224x224 image against 92 us for the plain loop, a
   fifth of the time the decode of the whole image takes otherwise added. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
__attribute__((target_clones("avx2", "ssse3", "default")))
#endif
static void planes_row(const unsigned char *restrict src, unsigned char *restrict r,
                       unsigned char *restrict g, unsigned char *restrict b, int width) {
    /* size_t, not int: Python builds with -fwrapv, and a wrapping int index keeps the
       vectorizer from seeing the stride-3 pattern (the loop stayed scalar, a byte at a time) */
    const size_t n = width > 0 ? (size_t)width : 0;
    for (size_t c = 0; c < n; c++) {
        r[c] = src[3 * c];
        g[c] = src[3 * c + 1];
        b[c] = src[3 * c + 2];
    }
}

static int decode_one(const unsigned char *buf, size_t len, int denom, int top, int left,
                      int height, int width, unsigned char *dst, int planar,
                      size_t plane, size_t row_stride, char *problem, size_t problem_size) {
    struct jpeg_decompress_struct cinfo;
    struct region_error err;
    /* volatile: read after a longjmp */
    unsigned char *volatile rows = NULL;
    volatile int failed = 0;

    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    err.message[0] = 0;
    if (setjmp(err.jump)) {
        failed = 1;
        snprintf(problem, problem_size, "%s", err.message);
    } else {
        jpeg_create_decompress(&cinfo);
        jpeg_mem_src(&cinfo, buf, (unsigned long)len);
        jpeg_read_header(&cinfo, TRUE);
        cinfo.out_color_space = JCS_RGB;
        cinfo.scale_num = 1;
        cinfo.scale_denom = (unsigned int)denom;
        jpeg_start_decompress(&cinfo);
        if ((JDIMENSION)(top + height) > cinfo.output_height ||
            (JDIMENSION)(left + width) > cinfo.output_width) {
            failed = 1;
            snprintf(problem, problem_size,
                     "window %dx%d at (%d, %d) is outside the %ux%u scaled image", width,
                     height, left, top, cinfo.output_width, cinfo.output_height);
        } else {
            JDIMENSION x = (JDIMENSION)left, w = (JDIMENSION)width;
            if (w < cinfo.output_width && w < WHOLE_ROWS_FROM * cinfo.output_width)
                jpeg_crop_scanline(&cinfo, &x, &w); /* x down, w up, to whole iMCUs */
            else if (w < cinfo.output_width) {
                x = 0;
                w = cinfo.output_width;
            }
            size_t skip = (size_t)(left - (int)x) * 3, stride = (size_t)w * 3;
            /* whole-width interleaved windows are read straight into dst; the others
               through a buffer of up to ROWS rows */
            int direct = (!planar && skip == 0 && w == (JDIMENSION)width);
            /* scanlines a call: ROWS straight into dst, else as many as ROWS_BYTES holds */
            int batch = direct ? ROWS : (int)(ROWS_BYTES / (stride ? stride : 1));
            batch = batch < 2 ? 2 : (batch > ROWS ? ROWS : batch);
            rows = direct ? NULL : (unsigned char *)malloc(stride * (size_t)batch);
            if (!direct && rows == NULL) {
                failed = 1;
                snprintf(problem, problem_size, "out of memory");
            } else {
                JSAMPROW pointers[ROWS];
                if (top > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)top);
                int done = 0;
                while (done < height) {
                    int want = height - done < batch ? height - done : batch;
                    for (int k = 0; k < want; k++)
                        pointers[k] = direct ? dst + (size_t)(done + k) * row_stride
                                             : rows + k * stride;
                    JDIMENSION got = jpeg_read_scanlines(&cinfo, pointers, (JDIMENSION)want);
                    if (got == 0) {
                        failed = 1;
                        snprintf(problem, problem_size, "no more scanlines");
                        break;
                    }
                    for (JDIMENSION k = 0; k < got && !direct; k++) {
                        const unsigned char *src = pointers[k] + skip;
                        size_t y = (size_t)(done + (int)k);
                        if (planar) {
                            unsigned char *r = dst + y * row_stride;
                            planes_row(src, r, r + plane, r + 2 * plane, width);
                        } else {
                            memcpy(dst + y * row_stride, src, (size_t)width * 3);
                        }
                    }
                    done += (int)got;
                }
            }
        }
    }
    jpeg_destroy_decompress(&cinfo);
    free(rows);
    return failed;
}

static int check_window(int denom, int top, int left, int height, int width) {
    if (!(denom == 1 || denom == 2 || denom == 4 || denom == 8) || top < 0 || left < 0 ||
        height < 1 || width < 1) {
        PyErr_SetString(PyExc_ValueError, "denom must be 1, 2, 4 or 8 and the window non-empty");
        return 0;
    }
    return 1;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer data;
    int denom, top, left, height, width;
    if (!PyArg_ParseTuple(args, "y*iiiii", &data, &denom, &top, &left, &height, &width))
        return NULL;
    if (!check_window(denom, top, left, height, width)) {
        PyBuffer_Release(&data);
        return NULL;
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)height * width * 3);
    if (out == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    unsigned char *pixels = (unsigned char *)PyByteArray_AS_STRING(out);
    char problem[JMSG_LENGTH_MAX + 64];
    problem[0] = 0;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = decode_one((const unsigned char *)data.buf, (size_t)data.len, denom, top, left,
                        height, width, pixels, 0, 0, (size_t)width * 3, problem, sizeof problem);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (failed) {
        Py_DECREF(out);
        PyErr_Format(PyExc_ValueError, "libjpeg: %s", problem);
        return NULL;
    }
    return out;
}

/* decode_batch(items) -> list of None (decoded) or str (why not), one per item; each item
 * is (data, denom, top, left, height, width, dest, planar[, plane_stride, row_stride]):
 * the window decoded into the writable buffer dest, as CHW planes when planar (each
 * plane_stride bytes after the last, rows row_stride bytes apart; by default
 * height * width and width: a contiguous image), else HWC rows row_stride bytes apart
 * (plane_stride unused; by default width * 3: a contiguous image). An HWC window of
 * whole scanlines is written by libjpeg straight into its rows (no copy at all: a
 * channels-last batch slot, runner/data/loading/buffers.py).
 * The whole batch runs without the GIL: one call, not one per image. */
struct job {
    Py_buffer data, dest;
    int denom, top, left, height, width, planar, failed;
    Py_ssize_t plane, row;
    char problem[JMSG_LENGTH_MAX + 64];
};

static PyObject *decode_batch(PyObject *self, PyObject *args) {
    PyObject *items;
    if (!PyArg_ParseTuple(args, "O", &items)) return NULL;
    PyObject *seq = PySequence_Fast(items, "decode_batch takes a sequence of items");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), parsed = 0;
    struct job *jobs = (struct job *)calloc(n > 0 ? (size_t)n : 1, sizeof(struct job));
    PyObject *result = NULL;
    if (jobs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; parsed < n; parsed++) {
        struct job *j = &jobs[parsed];
        j->plane = j->row = -1;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, parsed), "y*iiiiiw*p|nn",
                              &j->data, &j->denom, &j->top, &j->left, &j->height, &j->width,
                              &j->dest, &j->planar, &j->plane, &j->row))
            goto done;
        Py_ssize_t pixel = j->planar ? 1 : 3; /* bytes of a pixel in a row */
        if (j->plane < 0) j->plane = (Py_ssize_t)j->height * j->width;
        if (j->row < 0) j->row = (Py_ssize_t)j->width * pixel;
        /* the last byte written: the last (plane's) last row's last pixel */
        Py_ssize_t reach = (j->planar ? 2 * j->plane : 0) +
                           (Py_ssize_t)(j->height - 1) * j->row + (Py_ssize_t)j->width * pixel;
        if (j->row < (Py_ssize_t)j->width * pixel ||
            (j->planar && j->plane < (Py_ssize_t)j->height * j->row - (j->row - j->width))) {
            PyErr_SetString(PyExc_ValueError, "the planes' strides overlap their rows");
            parsed++;
            goto done;
        }
        if (!check_window(j->denom, j->top, j->left, j->height, j->width) ||
            j->dest.len < reach) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "dest is smaller than the window's pixels");
            parsed++; /* its buffers are held: released below */
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++) {
        struct job *j = &jobs[k];
        j->failed = decode_one((const unsigned char *)j->data.buf, (size_t)j->data.len,
                               j->denom, j->top, j->left, j->height, j->width,
                               (unsigned char *)j->dest.buf, j->planar, (size_t)j->plane,
                               (size_t)j->row, j->problem, sizeof j->problem);
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    for (Py_ssize_t k = 0; result != NULL && k < n; k++) {
        PyObject *v = jobs[k].failed ? PyUnicode_FromFormat("libjpeg: %s", jobs[k].problem)
                                     : Py_NewRef(Py_None);
        if (v == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, k, v);
    }
done:
    for (Py_ssize_t k = 0; jobs != NULL && k < parsed; k++) {
        if (jobs[k].data.obj != NULL) PyBuffer_Release(&jobs[k].data);
        if (jobs[k].dest.obj != NULL) PyBuffer_Release(&jobs[k].dest);
    }
    free(jobs);
    Py_DECREF(seq);
    return result;
}

/* Bilinear upsampling of uint8 images, CHW planes out (runner.data.decode.decoders's
 * resize_into; measured here about twice as fast as torch's antialiased uint8 kernel on
 * the crops of random-resized crops, which are nearly all enlargements).
 *
 * The source is any strided 3-channel uint8 image (an HWC buffer, a CHW window of a
 * store); the output is a contiguous CHW image at least as large on both axes (an
 * enlargement: the bilinear filter then reads two pixels per axis, and its result is the
 * antialiased bilinear resize's, half-pixel centres and edges clamped, up to rounding).
 * Separable, in fixed point: rows first (weights of 11 bits into an int32 buffer), then
 * columns, rounded once. */
#define FRAC_BITS 11
#define ONE (1 << FRAC_BITS)

static void axis_taps(int in, int out, int *first, int32_t *second_weight) {
    double scale = (double)in / out;
    for (int o = 0; o < out; o++) {
        double c = (o + 0.5) * scale - 0.5;
        int i0;
        double frac;
        if (c <= 0) {
            i0 = 0;
            frac = 0;
        } else {
            i0 = (int)c;
            frac = c - i0;
            if (i0 >= in - 1) {
                i0 = in - 1;
                frac = 0;
            }
        }
        first[o] = i0;
        second_weight[o] = (int32_t)(frac * ONE + 0.5);
    }
}

/* the loops vectorize with SSE4.1's 32-bit multiply (measured: 156 us for 150x150 -> 224x224
   against 285 us with SSE2 alone); each machine runs the best clone it has */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
__attribute__((target_clones("avx2", "sse4.1", "default")))
#endif
static int resize_one(const unsigned char *src, Py_ssize_t sc, Py_ssize_t sy, Py_ssize_t sx,
                      int h, int w, unsigned char *dst, int oh, int ow, int flip) {
    int *xi = (int *)malloc(sizeof(int) * (size_t)(ow + oh));
    int32_t *xw = (int32_t *)malloc(sizeof(int32_t) * (size_t)(ow + oh));
    int32_t *tmp = (int32_t *)malloc(sizeof(int32_t) * (size_t)h * ow);
    if (xi == NULL || xw == NULL || tmp == NULL) {
        free(xi);
        free(xw);
        free(tmp);
        return 1;
    }
    int *yi = xi + ow;
    int32_t *yw = xw + ow;
    axis_taps(w, ow, xi, xw);
    axis_taps(h, oh, yi, yw);
    for (int c = 0; c < 3; c++) {
        const unsigned char *plane = src + c * sc;
        for (int y = 0; y < h; y++) {
            const unsigned char *row = plane + y * sy;
            int32_t *t = tmp + (size_t)y * ow;
            for (int x = 0; x < ow; x++) {
                int i0 = xi[x], i1 = i0 + 1 < w ? i0 + 1 : i0;
                int32_t a = row[i0 * sx], b = row[i1 * sx];
                t[x] = a * (ONE - xw[x]) + b * xw[x];
            }
        }
        unsigned char *out = dst + (size_t)c * oh * ow;
        for (int y = 0; y < oh; y++) {
            int i0 = yi[y], i1 = i0 + 1 < h ? i0 + 1 : i0;
            const int32_t *t0 = tmp + (size_t)i0 * ow, *t1 = tmp + (size_t)i1 * ow;
            int32_t v = yw[y];
            unsigned char *o = out + (size_t)y * ow;
            /* t0 * (ONE - v) + t1 * v <= 255 * ONE * ONE: fits an int32 */
            if (flip) {
                for (int x = 0; x < ow; x++)
                    o[ow - 1 - x] = (unsigned char)((t0[x] * (ONE - v) + t1[x] * v +
                                                     (1 << (2 * FRAC_BITS - 1))) >> (2 * FRAC_BITS));
            } else {
                for (int x = 0; x < ow; x++)
                    o[x] = (unsigned char)((t0[x] * (ONE - v) + t1[x] * v +
                                            (1 << (2 * FRAC_BITS - 1))) >> (2 * FRAC_BITS));
            }
        }
    }
    free(xi);
    free(xw);
    free(tmp);
    return 0;
}

/* upsample_batch(items): each item (src address, channel stride, row stride, column stride,
 * height, width, dst address, out height, out width, flip) resized into the contiguous CHW
 * uint8 image at dst; addresses of tensors the caller holds for the call. Without the GIL.
 * Raises ValueError for an item that is not an enlargement. */
static PyObject *upsample_batch(PyObject *self, PyObject *args) {
    PyObject *items;
    if (!PyArg_ParseTuple(args, "O", &items)) return NULL;
    PyObject *seq = PySequence_Fast(items, "upsample_batch takes a sequence of items");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    struct resize_job {
        unsigned long long src, dst;
        Py_ssize_t sc, sy, sx;
        int h, w, oh, ow, flip;
    } *jobs = calloc(n > 0 ? (size_t)n : 1, sizeof *jobs);
    if (jobs == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        struct resize_job *j = &jobs[k];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "KnnniiKiip", &j->src, &j->sc,
                              &j->sy, &j->sx, &j->h, &j->w, &j->dst, &j->oh, &j->ow,
                              &j->flip) ||
            (j->h < 1 || j->w < 1 || j->h > j->oh || j->w > j->ow ?
                 (PyErr_SetString(PyExc_ValueError,
                                  "upsample_batch: every item must be an enlargement"), 1) : 0)) {
            free(jobs);
            Py_DECREF(seq);
            return NULL;
        }
    }
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n && !failed; k++) {
        struct resize_job *j = &jobs[k];
        failed = resize_one((const unsigned char *)(uintptr_t)j->src, j->sc, j->sy, j->sx, j->h,
                            j->w, (unsigned char *)(uintptr_t)j->dst, j->oh, j->ow, j->flip);
    }
    Py_END_ALLOW_THREADS
    free(jobs);
    Py_DECREF(seq);
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(data, denom, top, left, height, width) -> bytearray of height*width*3 RGB "
     "bytes: the window of the image scaled by 1/denom, decoded alone."},
    {"decode_batch", decode_batch, METH_VARARGS,
     "decode_batch(items) -> [None or error] per item (data, denom, top, left, height, "
     "width, dest, planar[, plane_stride, row_stride]): each window decoded into dest (CHW "
     "planes, strides in bytes, or HWC), the whole batch without the GIL."},
    {"upsample_batch", upsample_batch, METH_VARARGS,
     "upsample_batch(items) -> None: each (src address, channel, row and column strides, "
     "height, width, dst address, out height, out width, flip) enlarged bilinearly into the "
     "contiguous CHW uint8 image at dst, the whole list without the GIL."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegregion",
                                    "Region-of-interest JPEG decoding (libjpeg-turbo).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__jpegregion(void) { return PyModule_Create(&module); }
