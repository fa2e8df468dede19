/* Region-of-interest JPEG decoding with libjpeg-turbo (runner.data.storage._jpegregion).
 *
 * decode(data, denom, top, left, height, width) -> bytearray (height * width * 3, RGB)
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
#include <string.h>
#include <jpeglib.h>

#define ROWS 32 /* scanlines asked for per call */

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

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer data;
    int denom, top, left, height, width;
    if (!PyArg_ParseTuple(args, "y*iiiii", &data, &denom, &top, &left, &height, &width))
        return NULL;
    if (!(denom == 1 || denom == 2 || denom == 4 || denom == 8) || top < 0 || left < 0 ||
        height < 1 || width < 1) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "denom must be 1, 2, 4 or 8 and the window non-empty");
        return NULL;
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)height * width * 3);
    if (out == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    unsigned char *pixels = (unsigned char *)PyByteArray_AS_STRING(out);

    struct jpeg_decompress_struct cinfo;
    struct region_error err;
    /* volatile: read after a longjmp */
    unsigned char *volatile rows = NULL;
    volatile int failed = 0;
    char problem[JMSG_LENGTH_MAX + 64];
    problem[0] = 0;

    Py_BEGIN_ALLOW_THREADS
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    err.message[0] = 0;
    if (setjmp(err.jump)) {
        failed = 1;
        snprintf(problem, sizeof problem, "%s", err.message);
    } else {
        jpeg_create_decompress(&cinfo);
        jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
        jpeg_read_header(&cinfo, TRUE);
        cinfo.out_color_space = JCS_RGB;
        cinfo.scale_num = 1;
        cinfo.scale_denom = (unsigned int)denom;
        jpeg_start_decompress(&cinfo);
        if ((JDIMENSION)(top + height) > cinfo.output_height ||
            (JDIMENSION)(left + width) > cinfo.output_width) {
            failed = 1;
            snprintf(problem, sizeof problem,
                     "window %dx%d at (%d, %d) is outside the %ux%u scaled image", width,
                     height, left, top, cinfo.output_width, cinfo.output_height);
        } else {
            JDIMENSION x = (JDIMENSION)left, w = (JDIMENSION)width;
            if (w < cinfo.output_width)
                jpeg_crop_scanline(&cinfo, &x, &w); /* x down, w up, to whole iMCUs */
            size_t skip = (size_t)(left - (int)x) * 3, stride = (size_t)w * 3;
            /* whole-width windows are read straight into the output; cropped ones through
               a buffer of ROWS rows (crop_scanline's widened rows) */
            int direct = (skip == 0 && w == (JDIMENSION)width);
            rows = direct ? NULL : (unsigned char *)malloc(stride * ROWS);
            if (!direct && rows == NULL) {
                failed = 1;
                snprintf(problem, sizeof problem, "out of memory");
            } else {
                JSAMPROW pointers[ROWS];
                if (top > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)top);
                int done = 0;
                while (done < height) {
                    int want = height - done < ROWS ? height - done : ROWS;
                    for (int k = 0; k < want; k++)
                        pointers[k] = direct ? pixels + (size_t)(done + k) * stride
                                             : rows + k * stride;
                    JDIMENSION got = jpeg_read_scanlines(&cinfo, pointers, (JDIMENSION)want);
                    if (got == 0) {
                        failed = 1;
                        snprintf(problem, sizeof problem, "no more scanlines");
                        break;
                    }
                    if (!direct)
                        for (JDIMENSION k = 0; k < got; k++)
                            memcpy(pixels + (size_t)(done + k) * width * 3, pointers[k] + skip,
                                   (size_t)width * 3);
                    done += (int)got;
                }
            }
        }
    }
    jpeg_destroy_decompress(&cinfo);
    free(rows);
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&data);
    if (failed) {
        Py_DECREF(out);
        PyErr_Format(PyExc_ValueError, "libjpeg: %s", problem);
        return NULL;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(data, denom, top, left, height, width) -> bytearray of height*width*3 RGB "
     "bytes: the window of the image scaled by 1/denom, decoded alone."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegregion",
                                    "Region-of-interest JPEG decoding (libjpeg-turbo).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__jpegregion(void) { return PyModule_Create(&module); }
