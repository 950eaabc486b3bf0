"""Everything that runs inside a jail: the driver, its end of the channel, notebook lines and
magics, the matplotlib backend, the model tools' parts. Standard library only at import
(numpy & co. lazily); nothing here imports the rest of the package, since only this folder
(and `appliance.tools`, its public face) is staged into a jail's runtime."""
